"""kdcache: cache a Hugging Face teacher's hidden states, attention maps and logits once, then distil students
from the cache under DeepSpeed ZeRO.

The three packages live at the top of the source tree and install under this one name, so that a user's own
``pipeline.py``, ``stages.py`` or ``storage/`` in the working directory never shadows them:

- ``kdcache.pipeline``: the face (the ``kdcache`` CLI, config, demo, reports, sweeps);
- ``kdcache.stages``: stage one (teacher precompute) and stage two (student training);
- ``kdcache.storage``: the cache format, its backends and stores.

Data flows one way: pipeline -> stages -> storage.
"""

__version__ = "0.1.0"
