"""The one compiled part of omnid: the spawner's path from fork to exec (omnid/process/_spawnc.c).

Optional: where no C compiler or Python headers are, the build says so and goes on, and the
spawner runs its Python path instead (slower between fork and exec, the same guarantees).
`omnid check --this-host` says which path a host has. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "omnid.process._spawnc",
            ["omnid/process/_spawnc.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    ],
)
