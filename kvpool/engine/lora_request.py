"""`LoRARequest`: which PEFT adapter a request runs with (vLLM's shape), and `--lora-modules` parsing.

The adapter's name is its identity to clients: the `model` a client sends, the entry in `/v1/models`, the
LoRA name in KV events. Its cached KV blocks are hashed under the name and the digest of the adapter's
files (`kvpool.runner.file_identity`), so blocks are shared between requests of one adapter and never
across adapters, nor with another adapter that later carries the same name (on another replica, or after
a restart, both of which a shared KV store outlives). The integer id is vLLM's bookkeeping and is
checked for consistency with the name, nothing more.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.runner.file_identity import files_digest


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest("sql", 1, "/path/to/adapter")`: a PEFT folder (adapter_config.json and
    adapter_model.safetensors) served under `lora_name`; `lora_int_id` > 0 names it to the engine."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request: lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"lora_request: adapter {self.lora_name!r} has no lora_path")

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(specs: Sequence[str]) -> list[LoRARequest]:
    """`--lora-modules` values: `name=PATH`, or vLLM's JSON form `{"name": ..., "path": ...,
    "base_model_name": ...}`; ids are given in order from 1. ValueError on a malformed or repeated name."""
    out: list[LoRARequest] = []
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                d = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {spec!r} is not valid JSON ({e.msg})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"lora_modules: {spec!r} needs string fields 'name' and 'path'")
            name, path, base = d["name"], d["path"], d.get("base_model_name")
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {spec!r} is not of the form name=PATH")
            base = None
        if any(r.lora_name == name for r in out):
            raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
        out.append(LoRARequest(name, len(out) + 1, path, base))
    return out


class LoRARegistry:
    """The engine's adapters by name: each `LoRARequest` seen is checked against the ones before it
    (a name is one id and one folder, an id one name) and loaded into the runner once."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager  # kvpool.runner.lora.LoRAManager
        self.requests: dict[str, LoRARequest] = {}
        self.digests: dict[str, str] = {}  # name -> digest of the adapter's files
        self._lock = threading.Lock()  # the maps (read by every request)
        # New adapters one at a time, from the check to the insert: two requests naming one new adapter
        # from two folders (or one id for two names) at once must not both pass the check and load.
        self._adding = threading.Lock()

    def add(self, req: LoRARequest) -> str:
        """The adapter's name (its cache key); ValueError for a conflicting or unloadable adapter."""
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(req).__name__}")
        if self._known(req):
            if not self.manager.loaded(req.lora_name):
                self.reload(req.lora_name)
            return req.lora_name
        with self._adding:  # (loading reads the folder: the maps' lock stays free for known adapters)
            if self._known(req):
                return req.lora_name
            digest = self._load(req)
            with self._lock:
                self.requests[req.lora_name] = req
                self.digests[req.lora_name] = digest
        return req.lora_name

    def _load(self, req: LoRARequest, want: str | None = None) -> str:
        """Load the adapter's weights from its folder; the digest of its files. `want`: the digest it was
        registered with, which the files must still have (a reload: its cached blocks are keyed by it)."""
        folder = Path(req.lora_path)
        files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
        before = files_digest(files) if all(f.is_file() for f in files) else None
        if want is not None and before != want:
            raise ValueError(f"lora_request: the files of adapter {req.lora_name!r} in {req.lora_path!r} changed "
                             f"since it was first loaded (its cached KV was computed with those); add it under a "
                             f"new name")
        self.manager.register(req.lora_name, req.lora_path)
        digest = files_digest(files)
        if digest != before:
            # Rewritten while it was read: the weights loaded may be neither version, and the blocks would be
            # keyed by a digest of files other than the ones computed with.
            self.manager.forget(req.lora_name)
            raise ValueError(f"lora_request: the adapter files in {req.lora_path!r} changed while they were "
                             f"read; send the request again")
        return digest

    def _known(self, req: LoRARequest) -> bool:
        """True if `req` is a registered adapter; ValueError if it conflicts with one (name or id)."""
        with self._lock:
            have = self.requests.get(req.lora_name)
            if have is not None and have.lora_int_id == req.lora_int_id and have.lora_path == req.lora_path:
                return True
            if have is not None:
                raise ValueError(f"lora_request: adapter name {req.lora_name!r} is already in use as id "
                                 f"{have.lora_int_id} from {have.lora_path!r}")
            for other in self.requests.values():
                if other.lora_int_id == req.lora_int_id:
                    raise ValueError(f"lora_request: lora_int_id {req.lora_int_id} is already adapter "
                                     f"{other.lora_name!r}")
        return False

    def reload(self, name: str) -> None:
        """Load a registered adapter unloaded since (max_cpu_loras) from its folder again, refused (ValueError)
        if its files are no longer the ones it was registered with: its cached KV blocks are keyed by those."""
        if self.manager.loaded(name):
            return
        with self._adding:
            if self.manager.loaded(name):
                return
            with self._lock:
                req, digest = self.requests[name], self.digests[name]
            self._load(req, digest)

    def name_of(self, lora: int | str) -> str | None:
        """The name of the registered adapter with this name or int id; None if there is none."""
        with self._lock:
            if isinstance(lora, str):
                return lora if lora in self.requests else None
            return next((n for n, r in self.requests.items() if r.lora_int_id == lora), None)

    def remove(self, name: str) -> None:
        """Forget a registered adapter, its weights and its slot (the engine checked that no request uses it)."""
        with self._adding, self._lock:
            self.requests.pop(name, None)
            self.digests.pop(name, None)
            self.manager.unload(name)

    def content_digest(self, name: str) -> str:
        """The digest of a registered adapter's files (hashed into its blocks with its name)."""
        return self.digests[name]
