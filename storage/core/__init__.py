"""Storage's ground floor: what every other part of storage builds on, importing nothing of storage beyond it.

Errors (``errors``) and the one registry type (``registry``); the names of a cache's arrays and streams
(``streams``) and the layouts that name them per attention source and logit mode (``attention_source``,
``logit_layouts``); dtypes, numcodecs configurations and the hidden codecs' rotation (``dtypes``, ``codecs``,
``rotation``); bytes on disk or in an object store (``files``, ``canonical``, ``leases``, ``stores``); format
versions (``formats``) and the backends by name (``backend_registry``, whose implementations in
``storage.backends`` load on first use).

The floors above, each importing only those below it: ``hidden_codecs``; ``schema`` (the spec and the manifest);
``backends``; and the modules of ``storage`` itself, which encode, write, read and verify a cache. Outside storage
these names are imported from its front door, ``kdcache.storage``.
"""
