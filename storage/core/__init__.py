"""Storage's ground floor: errors, the one registry type, array and stream names, the attention and logit layouts,
dtypes, codecs, the rotation, files and stores, format versions and the backends by name; it imports nothing of
storage above it (the floors are listed in ``kdcache.storage``'s docstring, whose front door exports these names).
"""
