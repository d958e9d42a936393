"""Build hpctrain's pydantic models with pydantic's plugins off (without loading the plugin finder) and with
the cyclic garbage collector paused.

Every model build asks pydantic for its plugins (pydantic/plugin/_schema_validator.py imports
`get_plugins` from pydantic.plugin._loader at each build). That module imports importlib.metadata at its
top, which imports email, zipfile, csv, socket and more (~11 ms), and its first call reads the entry points
of every installed distribution (~5 ms here, more in a bigger environment): together an eighth of
`hpctrain validate` (issue 23 item 8). hpctrain's models take no pydantic plugin, so while they are built:

- PYDANTIC_DISABLE_PLUGINS=__all__ (pydantic's own switch, read at each build), put back as it was (or
  removed) afterwards, so neither later models, os.environ nor a child process sees it;
- when the finder is not loaded yet, a stand-in module under its name whose get_plugins() returns no
  plugins (what the switch makes the real one return); any other name asked of it loads the real module
  and answers from it. The stand-in leaves sys.modules afterwards: the next model built elsewhere loads
  the real finder as usual, plugins and all.

`secrets_on_first_use` does the same for the `secrets` module, which pydantic.types imports at its top and
uses only when two SecretStr/SecretBytes values are compared: importing it loads hmac, hashlib with OpenSSL's
_hashlib, and random (~2 ms of validate). While pydantic is imported a stand-in takes its place; the first
name asked of it loads the real module (the stand-in has left sys.modules by then, so every other importer
gets the real one too).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

LOADER = "pydantic.plugin._loader"
SWITCH = "PYDANTIC_DISABLE_PLUGINS"


class _NoPlugins(ModuleType):
    """Stands in for pydantic.plugin._loader while hpctrain's models are built."""

    @staticmethod
    def get_plugins() -> tuple[()]:
        return ()

    def __getattr__(self, name: str) -> Any:
        # Not expected (pydantic asks for get_plugins only); should a pydantic version ask for more, answer
        # from the real module rather than fail. Dunders (the import system asks for __path__) are not there.
        if name.startswith("__"):
            raise AttributeError(name)
        if sys.modules.get(LOADER) is self:
            del sys.modules[LOADER]
        import importlib

        return getattr(importlib.import_module(LOADER), name)


@contextmanager
def pydantic_plugins_off() -> Iterator[None]:
    setting = os.environ.get(SWITCH)
    os.environ[SWITCH] = "__all__"
    stand_in = None
    if LOADER not in sys.modules:
        stand_in = sys.modules[LOADER] = _NoPlugins(LOADER)
    try:
        yield
    finally:
        if setting is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = setting
        if stand_in is not None:
            if sys.modules.get(LOADER) is stand_in:
                del sys.modules[LOADER]
            package = sys.modules.get(LOADER.rpartition(".")[0])
            if package is not None and getattr(package, "_loader", None) is stand_in:
                delattr(package, "_loader")


class _OnFirstUse(ModuleType):
    """Stands in for a stdlib module that pydantic imports but does not use while models are built."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        import importlib

        return getattr(importlib.import_module(self.__name__), name)


@contextmanager
def secrets_on_first_use() -> Iterator[None]:
    """`import secrets` inside gets a stand-in that loads the real module at its first use (module docstring)."""
    stand_in = None
    if "secrets" not in sys.modules:
        stand_in = sys.modules["secrets"] = _OnFirstUse("secrets")
    try:
        yield
    finally:
        if stand_in is not None and sys.modules.get("secrets") is stand_in:
            del sys.modules["secrets"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while the schema is imported and built (pydantic's own import included,
    as hpctrain.config is what first imports it on the command line).

    Importing pydantic and building the ~30 models allocates ~30k objects that all stay alive, so the
    young-generation collections the allocations trigger on the way (~70) find next to nothing to free
    (~1 ms of `hpctrain validate`, issue 23 item 8). The planner's search pauses it too (plan/search.py): its
    ~10^5 objects form no cycles, and the collector's passes over them cost ~3 % of a long search. The collector
    is put back as it was afterwards, also when the block raises; garbage made meanwhile is collected at its next
    run."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
