"""Build hook for the optional native extensions: the copy kernel (aiokv._native._copy), chained block hashing
(aiokv._native._sha), the C fast path of Request.step (aiokv._native._step) and the block index's LRU replay
loops (aiokv._native._lru).

Everything else lives in pyproject.toml. All four are optional: when no C compiler is available aiokv falls
back to a numpy per-block loop for copies, to hashlib for hashes and to the Python methods for the rest
(slower, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"aiokv._native.{name}",
            sources=[f"aiokv/_native/{name}.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
        for name in ("_copy", "_lru", "_sha", "_step")
    ]
)
