"""JAX's persistent compilation cache, on by default for the CLI.

A training or decoding program of a real model takes from seconds to minutes to compile; with the cache a second run
of the same job (a resume after a crash or a preemption, the next run of a sweep, ``jaxalign eval`` after
``jaxalign train``) reads the compiled program back instead. ``jaxalign`` (the CLI) calls :func:`enable` before it
compiles anything; the Python API leaves JAX's setting alone, so call ``enable()`` yourself to get the same.

Where the cache lives, first match wins:

* ``JAXALIGN_COMPILATION_CACHE=off`` (or ``0``, ``false``, ``none``): no cache;
* ``JAXALIGN_COMPILATION_CACHE=PATH``: that folder, or a bucket URL (``gs://...``, with ``etils[epath]``);
* ``JAX_COMPILATION_CACHE_DIR`` (JAX's own variable) or a folder already set with ``jax.config``: left as it is;
* otherwise ``~/.cache/jaxalign/compilation`` (``$XDG_CACHE_HOME/jaxalign/compilation`` where that is set).

The cache is bounded (``JAXALIGN_COMPILATION_CACHE_GB``, default 4 GiB, least recently used entries go first), which
also makes JAX take a file lock around each read and write, so concurrent runs on one machine share the folder
safely. Every entry jaxalign writes ends in a SHA-256 digest of its contents, checked on every read: an entry that
is truncated (a run killed while writing it), altered or written without the digest is reported with a warning,
removed and compiled again (tested), so a damaged cache costs a compilation, never a wrong program. A folder that
cannot be created (a read-only home, say) gives one warning and the run goes on without a cache.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

OFF = ("off", "0", "false", "none", "no")
DEFAULT_GB = 4.0
MAGIC = b"jaxalign-sha256:"
_DIGEST = len(MAGIC) + 32


def seal(value: bytes) -> bytes:
    """``value`` followed by its digest, as a checked entry is stored."""
    return value + MAGIC + hashlib.sha256(value).digest()


def unseal(stored: bytes) -> bytes | None:
    """The value of a stored entry, or ``None`` where its digest is missing or does not match."""
    if len(stored) < _DIGEST or stored[-_DIGEST:-32] != MAGIC:
        return None
    value = stored[:-_DIGEST]
    return value if hashlib.sha256(value).digest() == stored[-32:] else None


def _checked_cache_class():
    """A cache over JAX's file cache that seals what it writes and drops what fails its check on reading."""
    from jax._src.compilation_cache_interface import CacheInterface

    class CheckedCache(CacheInterface):
        def __init__(self, base):
            self._base = base

        @property
        def _path(self):
            return self._base._path

        @_path.setter
        def _path(self, value):
            self._base._path = value

        def get(self, key: str) -> bytes | None:
            stored = self._base.get(key)
            if stored is None:
                return None
            value = unseal(stored)
            if value is None:
                entry = self._base._path / f"{key}-cache"  # a pathlib or an epath (bucket) path
                try:
                    entry.unlink(missing_ok=True)
                    removed = "removed"
                except OSError as err:
                    removed = f"not removed ({err})"
                warnings.warn(f"compilation cache: {entry} failed its SHA-256 check (truncated, altered or not "
                              f"written by jaxalign); {removed}, the program is compiled again", stacklevel=2)
            return value

        def put(self, key: str, value: bytes) -> None:
            self._base.put(key, seal(value))

    return CheckedCache


def _install_checks() -> bool:
    """Wrap the file cache JAX builds at its first compilation; ``False`` where this JAX has no such hook (its own
    checks then apply: zlib's checksum, or none for zstd)."""
    try:
        from jax._src import compilation_cache as jcc

        checked = _checked_cache_class()
        original = jcc.get_file_cache
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_jaxalign_checked", False):
        return True

    def get_file_cache(path):
        made = original(path)
        return None if made is None else (checked(made[0]), made[1])

    get_file_cache._jaxalign_checked = True
    jcc.get_file_cache = get_file_cache
    return True


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxalign" / "compilation"


_STATS = {"read": 0, "written": 0, "saved_seconds": 0.0}
_listening = False


def _listen() -> None:
    """Count the cache's reads and writes from JAX's monitoring events, once per process."""
    global _listening
    if _listening:
        return
    import jax.monitoring

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _STATS["read"] += 1
        elif event == "/jax/compilation_cache/cache_misses":  # JAX's name for an entry written after a miss
            _STATS["written"] += 1

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            _STATS["saved_seconds"] += seconds

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    _listening = True


def stats() -> dict:
    """Programs read back from the cache and written to it since :func:`enable`, and the compile seconds saved."""
    return dict(_STATS)


def summary(folder: Path | str | None) -> str:
    """One line for the end of a run: where the cache is and what it did."""
    if folder is None:
        return "off (JAXALIGN_COMPILATION_CACHE=off, or its folder was not usable)"
    s = _STATS
    return (f"{folder}: {s['read']} program(s) read back ({s['saved_seconds']:.1f}s of compilation saved), "
            f"{s['written']} written")


def enable(path: str | os.PathLike | None = None) -> Path | str | None:
    """Turn JAX's persistent compilation cache on; returns its folder, or ``None`` where it stays off.

    ``path`` overrides the environment (see the module's docstring). Call it before the first compilation: JAX sets
    its cache up once, at the first program it compiles."""
    import jax

    setting = os.environ.get("JAXALIGN_COMPILATION_CACHE", "").strip() if path is None else str(path)
    if setting.lower() in OFF:
        return None
    _listen()
    if not setting:
        existing = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
        if existing:
            return existing if "://" in existing else Path(existing)
    if "://" in setting:  # a shared bucket (gs://..., JAX opens it with etils[epath]); JAX checks it at first use
        _install_checks()
        jax.config.update("jax_compilation_cache_dir", setting)
        jax.config.update("jax_compilation_cache_max_size", _max_bytes())
        return setting
    folder = Path(setting).expanduser() if setting else default_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as err:
        warnings.warn(f"compilation cache off: cannot use {folder} ({err}); set JAXALIGN_COMPILATION_CACHE to a "
                      "writable folder, or to 'off'", stacklevel=2)
        return None
    max_bytes = _max_bytes()
    _install_checks()
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    return folder


def _max_bytes() -> int:
    try:
        gb = float(os.environ.get("JAXALIGN_COMPILATION_CACHE_GB", DEFAULT_GB))
    except ValueError as err:
        raise ValueError(f"JAXALIGN_COMPILATION_CACHE_GB={os.environ['JAXALIGN_COMPILATION_CACHE_GB']!r} is not a "
                         "number of GiB") from err
    if gb <= 0:
        raise ValueError(f"JAXALIGN_COMPILATION_CACHE_GB={gb} must be above 0 (JAXALIGN_COMPILATION_CACHE=off turns "
                         "the cache off)")
    return int(gb * 2**30)
