"""The shared-memory engine's C part (:mod:`tdist_tcp.shared.native`); everything else is in
pyproject.toml. The extension is optional: an install without a C compiler, or off
Linux x86-64, still succeeds, and the engine then runs the same protocol in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tdist_tcp.shared._shmfast",
            sources=["src/tdist_tcp/shared/_shmfast.c"],
            depends=["src/tdist_tcp/shared/_shmfast_reduce.h"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
