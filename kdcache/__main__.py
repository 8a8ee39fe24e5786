"""``python -m kdcache``, ``torchrun -m kdcache`` and ``deepspeed --module kdcache`` are the ``kdcache`` command."""

from kdcache.pipeline.cli import entry

entry()
