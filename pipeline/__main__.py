"""python -m pipeline is the same as kdcache."""

from pipeline.cli import entry

entry()
