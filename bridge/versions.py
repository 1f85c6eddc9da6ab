"""Noticing that a module's parameters changed, per call, at a cost that does not grow with their count
where it can.

The bridge's derived weights (jax views, fp16 copies, kernel layouts) are keyed by what torch records of
each parameter: its version counter (bumped by every in-place write torch sees: `load_state_dict`, an
optimizer step, `p.mul_()` under no_grad) and its data pointer (moved by `p.data = ...` and by `.to()`,
which does that to every parameter). Read one by one that is two C calls per parameter, ~7 us for an
official shape's 66 parameters on the CPU machine and 11-22 us on a slow H200 host
(`bench/results/host-parts-2026-12-04-h200.log`), the largest part of a Mosaic-launched call's host time.

- One version read for the whole module: `share_version_counter` gives the parameters of a module
  built by the bridge (`TTJTransformer`) one version counter, so an in-place write to any of them bumps
  the version every one of them reports. Their storages stay separate and nothing is a view of anything
  (state_dict, safetensors and torch.export see ordinary parameters); `p.data = ...` and `.to()` keep a
  parameter's counter. `shared_version_counter(params)` says whether a list of parameters is such a
  group: only the parameter objects made here count, so a deep copy or an unpickled module (whose
  parameters are new objects with counters of their own) is read parameter by parameter, as is any
  other module. The price: autograd checks saved tensors' versions. ttj-jax's backward saves every
  parameter, so nothing changes there; a graph that saved only one (a penalty on one weight) now
  fails its backward when another is written in place before it.
- One C call for the data pointers where torch has one (`torch._C._tensors_data_ptrs_at_indices_equal`,
  which inductor's CUDA graphs use for the same check; CUDA builds of torch), else one read each.
"""

from __future__ import annotations

import warnings
import weakref
from operator import attrgetter

import torch

_version_of = attrgetter("_version")
_data_ptr_of = torch.Tensor.data_ptr


def _checked_bulk_pointers_equal():
    """torch's C comparison of data pointers (private: inductor's), if this torch has it and it answers a
    known case right; else None (the pointers are then read one by one)."""
    compare = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if compare is None:
        return None
    a, b = torch.zeros(1), torch.zeros(1)
    try:
        right = (compare([a, b], [a.data_ptr(), b.data_ptr()], [0, 1]) is True
                 and compare([a, b], [a.data_ptr(), a.data_ptr()], [0, 1]) is False)
    except Exception:   # another signature in another torch
        return None
    return compare if right else None


_bulk_pointers_equal = _checked_bulk_pointers_equal()

# id(parameter) -> (weak reference to it, its group's token): the parameters share_version_counter made.
_GROUPS: dict[int, tuple[weakref.ref, object]] = {}


def share_version_counter(module: torch.nn.Module) -> None:
    """Replaces each of `module`'s parameters by a new Parameter object with the same tensor data,
    requires_grad and name, all of them sharing one version counter. For a module under construction:
    anything holding the old parameter objects (an optimizer) would keep training those."""
    if torch.is_inference_mode_enabled():   # inference tensors keep no version counter at all
        return
    owners = [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items()
              if p is not None]
    device = owners[0][2].device if owners else None
    if not owners or any(p.device != device for _, _, p in owners):
        return
    # Parameters made from views of one tensor share its version counter (nn.Parameter keeps the view's
    # counter and drops the view relation); `.data = ` then gives each its own storage back.
    base = torch.zeros(len(owners), device=device)
    made = []
    for i, (owner, name, p) in enumerate(owners):
        shared = torch.nn.Parameter(base[i:i + 1], requires_grad=p.requires_grad)
        shared.data = p.data
        owner._parameters[name] = shared
        made.append(shared)
    # Proof, not trust: a write to the base (ours alone) must move every parameter's version.
    before = [p._version for p in made]
    with torch.no_grad():
        base.zero_()
    if not all(p._version > v for p, v in zip(made, before)):
        return   # this torch does not share the counter that way: each parameter is read on its own
    token = object()
    for shared in made:
        key = id(shared)
        _GROUPS[key] = (weakref.ref(shared, lambda _, key=key: _GROUPS.pop(key, None)), token)


def _group_of(p: torch.Tensor):
    entry = _GROUPS.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def shared_version_counter(params: list[torch.Tensor]) -> bool:
    """Whether every one of `params` was made by one share_version_counter call (one version counter)."""
    token = _group_of(params[0]) if params else None
    return token is not None and all(_group_of(p) is token for p in params)


class ParameterWatch:
    """Tells whether `params` (a fixed list of parameter objects) changed since `mark()`: a version
    counter moved or a data pointer moved. Replaced parameter objects are the caller's to notice
    (bridge.runtime's structure check)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = list(params)
        self.shared = shared_version_counter(self.params)
        first = self.params[0]
        self._versions = ((lambda: first._version) if self.shared
                          else (lambda: list(map(_version_of, self.params))))
        self._indices = list(range(len(self.params)))
        self.versions = self.pointers = None
        self.warned = False

    def pointers_unchanged(self) -> bool:
        if self.pointers is None:
            return False
        if _bulk_pointers_equal is not None:
            return _bulk_pointers_equal(self.params, self.pointers, self._indices)
        return list(map(_data_ptr_of, self.params)) == self.pointers

    def _read_versions(self):
        try:
            return self._versions()
        except RuntimeError:   # an inference tensor (made or converted under torch.inference_mode) has none
            if not self.warned:
                self.warned = True
                warnings.warn("some of the module's parameters are inference tensors (made or converted under "
                              "torch.inference_mode), which keep no version counter: ttj-jax sees their "
                              "replacement and `.to()` but not in-place writes to them; call "
                              "bridge.refresh(module) after such writes", stacklevel=4)
            return [None if p.is_inference() else p._version for p in self.params]

    def changed(self) -> bool:
        """True until the first mark(), and whenever a version or data pointer moved since the last one."""
        return self._read_versions() != self.versions or not self.pointers_unchanged()

    def mark(self) -> None:
        self.versions = self._read_versions()
        self.pointers = list(map(_data_ptr_of, self.params))
