"""Generation with capture (issue 58): the teacher writes its own responses and its targets along them are kept
while it writes, so it runs once. A floor above ``capture`` (it reads ``core``, ``rows`` and ``capture``):
``options`` (the ``generate`` group and ``GenerateOptions``), ``prompts`` (the dataset into prompt ids),
``sampling`` (counter-based draws that depend only on the seed, the prompt, the response number and the step),
``decode`` (the decode loop with a KV cache that keeps the targets of the prefill and of each new token) and
``packed`` (``--packing documents``: the finished responses packed into rows without running the teacher again).
The command itself, which commits the shards, is ``stages.precompute.generate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.generation.decode import (
        Decoded as Decoded,
        DecodeLoop as DecodeLoop,
    )
    from kdcache.stages.precompute.generation.options import (
        SAMPLER as SAMPLER,
        GenerateOptions as GenerateOptions,
        GenerationOptions as GenerationOptions,
        Sampling as Sampling,
    )
    from kdcache.stages.precompute.generation.packed import (
        discard_leftover as discard_leftover,
        pack_plan as pack_plan,
        packed_streams as packed_streams,
        remove_unpacked as remove_unpacked,
        unpacked_path as unpacked_path,
        write_packed as write_packed,
    )
    from kdcache.stages.precompute.generation.prompts import (
        Prompts as Prompts,
        load_prompts as load_prompts,
    )
    from kdcache.stages.precompute.generation.sampling import (
        ResponseDraws as ResponseDraws,
        next_tokens as next_tokens,
        philox as philox,
        response_seed as response_seed,
        uniforms as uniforms,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
