"""Build hook for the optional C accelerator of the shared-memory ring.

The extension is optional: when it cannot be built, qlink falls back to its
pure-Python ring (same wire layout, slower), and says so in benchmark reports.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transports._ringc",
            sources=["transports/_ringc.c"],
            depends=["transports/_ringc_put.h"],  # included by _ringc.c
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        )
    ]
)
