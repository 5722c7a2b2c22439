"""Build hook for the optional native extensions: the copy kernel (aiokv._native._copy), chained block hashing
(aiokv._native._sha), the C fast path of Request.step (aiokv._native._step), the block index's LRU and ARC
loops (aiokv._native._lru, _arc), the replay simulator (aiokv._native._replay) and the persistent tiers' block
encodings (aiokv._native._codec).

Everything else lives in pyproject.toml. All are optional: when no C compiler is available aiokv falls
back to a numpy per-block loop for copies, to hashlib for hashes, to torch for the encodings and to the Python
methods for the rest (slower, same results).

AIOKV_SKIP_NATIVE_BUILD=1 installs without building them: for a second editable install over a source tree whose
extensions another venv of the same Python already built in place (the Makefile's .venv-vllm).
"""

import os

from setuptools import Extension, setup

SKIP = os.environ.get("AIOKV_SKIP_NATIVE_BUILD") == "1"

setup(
    ext_modules=[]
    if SKIP
    else [
        Extension(
            f"aiokv._native.{name}",
            sources=[f"aiokv/_native/{name}.c"],
            # _codec: its loops compare and select floats; without trapping math (aiokv never reads the
            # floating-point exception flags; results are IEEE's either way) the compiler vectorizes them, and
            # without contracting a*b+c into one rounding they stay byte for byte the torch definition's.
            extra_compile_args=["-O3", "-fno-trapping-math", "-ffp-contract=off"] if name == "_codec" else ["-O3"],
            optional=True,
        )
        for name in ("_arc", "_codec", "_copy", "_lru", "_replay", "_sha", "_step")
    ]
)
