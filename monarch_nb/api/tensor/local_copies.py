"""The copies torch makes of local tensors stay local under a mesh.

``copy.deepcopy`` of a local tensor (BatchNorm's ``num_batches_tracked``, an
optimizer's step count: host scalars) and the unpickling of one (``torch.load``,
pickle) make a new tensor with a factory and then ``set_`` it to a storage here.
Under ``mesh.activate()`` that factory made a mesh tensor, and the copy failed
("Attempted to set the storage of a tensor on device 'meta' ..."): so did
``copy.deepcopy(model)`` of a model with BatchNorm, ``AveragedModel`` and
``torch.load(path)`` inside a mesh block. Both run as local torch.
"""

from __future__ import annotations

import functools

import torch
import torch._utils

from .mode import active_mesh, no_mesh

_torch_deepcopy = getattr(torch.Tensor.__deepcopy__, "_mnb_wrapped", torch.Tensor.__deepcopy__)
_torch_rebuild = getattr(torch._utils._rebuild_tensor, "_mnb_wrapped", torch._utils._rebuild_tensor)


@functools.wraps(_torch_deepcopy)
def deepcopy_local(self, memo):
    """torch's ``Tensor.__deepcopy__``, outside the mesh's mode (mesh tensors have their own)."""
    if active_mesh() is None:
        return _torch_deepcopy(self, memo)
    with no_mesh():
        return _torch_deepcopy(self, memo)


@functools.wraps(_torch_rebuild)
def rebuild_local(storage, storage_offset, size, stride):
    """torch's ``_utils._rebuild_tensor`` (unpickling a tensor), outside the mesh's mode."""
    if active_mesh() is None:
        return _torch_rebuild(storage, storage_offset, size, stride)
    with no_mesh():
        return _torch_rebuild(storage, storage_offset, size, stride)


deepcopy_local._mnb_wrapped = _torch_deepcopy
rebuild_local._mnb_wrapped = _torch_rebuild
torch.Tensor.__deepcopy__ = deepcopy_local
torch._utils._rebuild_tensor = rebuild_local
