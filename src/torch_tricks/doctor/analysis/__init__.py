"""The doctor's shared reading of one file: what every static rule asks of the code.

:class:`FileAnalysis` parses nothing itself; it indexes an :mod:`ast` tree once: parents,
scopes, the bindings of each name in each function (assignments, loop targets, parameters,
imports), ``self.x = ...`` attributes per class, and the import aliases. On that index it
answers the questions the rules share, memoised: the *kind* of an expression (a tensor, a
batch from a DataLoader, a module, a loss, an optimizer ... :meth:`FileAnalysis.kind`), whether
a node runs with autograd off (:meth:`FileAnalysis.no_grad`), the calls of a frame, which loop
is a training loop (:func:`is_step_loop`), which loader feeds it and what it moves to CUDA.
Rules ask this package instead of matching their own spelling, so a model passed in as a
parameter or a tensor unpacked from a batch is recognised the same way by every rule.

Written on :mod:`ast` by hand: no linter framework (ruff, TorchFix's libcst visitors) exposes
a PyTorch-aware notion of "kind", and the doctor must run without importing torch.

Its modules, each importing only those before it here:

- :mod:`.vocab`: the torch names the rules know (activations, losses, tensor functions ...) and
  :func:`canon`, one spelling for each;
- :mod:`.syntax`: plain AST helpers (:func:`pos`, :func:`dotted`, :func:`kwarg`, :func:`walk_local` ...);
- :mod:`.kind`: :class:`Kind`, what a value is, and the derivations that need no file;
- :mod:`.kinds`, :mod:`.classes`, :mod:`.grad_mode`: the mixins :class:`FileAnalysis` is composed
  of: the kind of an expression, the file's module classes and what their forward returns,
  whether autograd is off;
- :mod:`.file`: :class:`FileAnalysis` itself (the index, name lookup, structure, calls per frame);
- :mod:`.loops`, :mod:`.loaders`, :mod:`.guards`: the queries on a FileAnalysis the rules share
  (training steps; DataLoaders and CUDA moves; compat guards, exclusive branches, rate limits).

Every name is importable from the package itself, as the rules do.
"""

from __future__ import annotations

from torch_tricks.doctor.analysis.vocab import (ACT_FUNCS, ACT_METHODS, ACT_MODULES, ACTS, CLOCKS, CONTAINERS,
                                                DATALOADER, DROPOUT_FNS, F_LOSSES, LOADERISH, MODULE_ONLY_METHODS,
                                                MODULE_SELF_METHODS, MOVE_METHODS, NO_GRAD, NON_TENSOR_METHODS,
                                                PARAMETER_FREE_MODULES, PARAMETER_FREE_NAME, RENAMED, RNN_MODULES,
                                                SAFE_BUILTINS, _SAME_ELEMENTS, SHAPE_METHODS, STATELESS_MODULES,
                                                SYNC_FUNCS, SYNC_METHODS, TENSOR_FUNCS, TQDM, VIEW_METHODS, WRAPPERS,
                                                canon, _exported_by_nn, is_loss, is_torch_nn_class, _public_home)
from torch_tricks.doctor.analysis.syntax import (COMPS, FUNCS, LOOPS, NOWHERE, SCOPES, _called_function,
                                                 called_method, _constant_index, dotted, end, has_star_args,
                                                 is_backward, _is_called, is_false, is_name, kwarg, number, pos,
                                                 _positional, _put_last, root_name, walk_local)
from torch_tricks.doctor.analysis.kind import (BATCH, _ELEMENTS, LOSS, PARAM, _PARAMETER_ATTRS, _PARAMETER_METHODS,
                                               TENSOR, _TENSOR_RESULTS, Kind, _activation, _agreed_kind,
                                               _batch_element, _category, _element_of, _is_local_instance,
                                               _is_module_base, _is_nn_module_class, _is_torch_tensor_function,
                                               _item_kind, _library_object_kind, _nn_object_kind, _optim_object_kind,
                                               _same_kind, _sole_activation, _takes_tensors, _tensor_attribute_kind,
                                               _tensor_function_kind, _tensor_method_kind)
from torch_tricks.doctor.analysis.kinds import (KindInference, _calls_module_method_on, _is_self_parameter)
from torch_tricks.doctor.analysis.classes import (ModuleClasses, _own_method, _returned_element, _self_method_call)
from torch_tricks.doctor.analysis.grad_mode import (_GRAD_MODE, GradMode, _bool_value, _mode_flag, _torch_grad_mode,
                                                    _wrapper_grad_mode)
from torch_tricks.doctor.analysis.file import (RECORDED, FileAnalysis, _imported_from, _imported_name, _last_before,
                                               _same_length_displays)
from torch_tricks.doctor.analysis.loops import (ancestors_until, backward_after, _calls_model, element_is_batch,
                                                enclosing_function, forward_before, _is_parameter, is_step_loop,
                                                looks_like_model, optimizer_step, unwrap_iterable)
from torch_tricks.doctor.analysis.loaders import (_COMBINERS, _DEVICE_NAME, _assignment_targets, dataloaders,
                                                  _find_dataloaders, is_cuda_device, _iterables, _iterates,
                                                  moves_batch_to_cuda, _moves_to_cuda, _named_like_device, _names_in,
                                                  _strings_in)
from torch_tricks.doctor.analysis.guards import (COMPAT_ERRORS, _branch_label, _branch_labels, catches_compat,
                                                 _compat_test, _exclusive, exclusive_branches, _guards_compat,
                                                 _identifier, _if_branch, _is_modulo, _names_memory, rate_limited,
                                                 version_guarded)

__all__ = [
    "ACT_FUNCS", "ACT_METHODS", "ACT_MODULES", "ACTS", "F_LOSSES", "TENSOR_FUNCS", "NON_TENSOR_METHODS",
    "VIEW_METHODS", "MODULE_SELF_METHODS", "SHAPE_METHODS", "MODULE_ONLY_METHODS", "MOVE_METHODS",
    "STATELESS_MODULES", "PARAMETER_FREE_MODULES", "PARAMETER_FREE_NAME", "RNN_MODULES", "CONTAINERS",
    "DROPOUT_FNS", "NO_GRAD", "CLOCKS", "SYNC_FUNCS", "SYNC_METHODS", "SAFE_BUILTINS", "TQDM", "LOADERISH",
    "DATALOADER", "WRAPPERS", "RENAMED", "canon", "is_torch_nn_class", "is_loss", "FUNCS", "COMPS", "SCOPES",
    "LOOPS", "NOWHERE", "pos", "end", "dotted", "root_name", "kwarg", "has_star_args", "number", "called_method",
    "is_name", "is_false", "is_backward", "walk_local", "Kind", "TENSOR", "LOSS", "PARAM", "BATCH",
    "KindInference", "ModuleClasses", "GradMode", "RECORDED", "FileAnalysis", "forward_before", "backward_after",
    "is_step_loop", "element_is_batch", "unwrap_iterable", "optimizer_step", "looks_like_model",
    "enclosing_function", "ancestors_until", "dataloaders", "moves_batch_to_cuda", "is_cuda_device",
    "COMPAT_ERRORS", "version_guarded", "catches_compat", "exclusive_branches", "rate_limited"
]
# the helpers' private names too: importable from here as when the analysis was one module
__all__ += [
    "_SAME_ELEMENTS", "_public_home", "_exported_by_nn", "_positional", "_put_last", "_constant_index",
    "_called_function", "_is_called", "_TENSOR_RESULTS", "_PARAMETER_ATTRS", "_PARAMETER_METHODS", "_ELEMENTS",
    "_category", "_is_local_instance", "_activation", "_same_kind", "_agreed_kind", "_sole_activation",
    "_tensor_attribute_kind", "_tensor_method_kind", "_item_kind", "_element_of", "_batch_element",
    "_nn_object_kind", "_library_object_kind", "_optim_object_kind", "_tensor_function_kind", "_is_module_base",
    "_is_nn_module_class", "_takes_tensors", "_is_torch_tensor_function", "_is_self_parameter",
    "_calls_module_method_on", "_self_method_call", "_returned_element", "_own_method", "_GRAD_MODE",
    "_torch_grad_mode", "_mode_flag", "_bool_value", "_wrapper_grad_mode", "_imported_name", "_imported_from",
    "_same_length_displays", "_last_before", "_calls_model", "_is_parameter", "_find_dataloaders",
    "_assignment_targets", "_iterates", "_COMBINERS", "_iterables", "_names_in", "_moves_to_cuda", "_DEVICE_NAME",
    "_named_like_device", "_strings_in", "_guards_compat", "_compat_test", "_identifier", "_branch_labels",
    "_branch_label", "_if_branch", "_exclusive", "_is_modulo", "_names_memory"
]
