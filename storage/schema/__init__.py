"""What a cache holds (``spec.CacheSpec``) and what it holds so far (``manifest``): above ``storage.core`` and
``storage.hidden_codecs`` (a spec carries its hidden codec), below ``storage.backends``, which pack and open shards
of a spec. Outside storage these names are imported from its front door, ``kdcache.storage``.
"""
