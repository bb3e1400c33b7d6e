"""Build hook for qlink's optional C accelerators.

* ``transports._ringc``: the shared-memory ring's hot path. When it cannot be built,
  qlink falls back to its pure-Python ring (same wire layout, slower), and says so in
  benchmark reports.
* ``transports._tcpc``: a tcp put's pieces into the socket by ``vmsplice`` and
  ``splice`` (Linux), so the sender copies nothing; without it a deferred tcp put is
  copied into the socket like any other.
* ``transports._cmac``: the pieces of a ``ucx://`` RMA put between two processes of one
  host, by ``process_vm_writev``/``readv``, many pieces per call; without it those pieces
  go by UCX, one call per piece.
* ``qlink.qec._hotcore``: the QEC loop's per-frame path over that ring (it uses the
  ring's C API, ``transports/_ring_api.h``). Without it, the loop runs its Python path
  and ``qlink.qec.hotpath.available()`` says why.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transports._ringc",
            sources=["transports/_ringc.c"],
            depends=["transports/_ringc_put.h", "transports/_ring_api.h"],  # included by _ringc.c
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "transports._tcpc",
            sources=["transports/_tcpc.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "transports._cmac",
            sources=["transports/_cmac.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "qlink.qec._hotcore",
            sources=["qlink/qec/_hotcore.c"],
            include_dirs=["transports"],
            depends=["transports/_ring_api.h"] + [f"qlink/qec/_hotcore_{part}.h" for part in  # included by _hotcore.c
                                                  ("io", "svc", "window", "frames", "pipe", "sessions", "ctl", "floor")],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
    ]
)
