"""The torch names the static rules know, and one spelling for each.

Tables of qualified names (activations, losses, tensor functions, layers without parameters,
clocks and synchronising calls, ...) and :func:`canon`, which turns the many spellings of one
torch object (``torch.nn.modules.loss.CrossEntropyLoss``, ``torch.autograd.no_grad``) into the one
these tables use. Kept apart so that the rules and every part of the analysis read the same
vocabulary; it imports nothing of the package.
"""

from __future__ import annotations

import re


ACT_FUNCS = {"torch.nn.functional.log_softmax": "log_softmax", "torch.log_softmax": "log_softmax",
             "torch.special.log_softmax": "log_softmax",
             "torch.nn.functional.softmax": "softmax", "torch.softmax": "softmax", "torch.special.softmax": "softmax",
             "torch.sigmoid": "sigmoid", "torch.nn.functional.sigmoid": "sigmoid", "torch.special.expit": "sigmoid"}
ACT_METHODS = {"log_softmax": "log_softmax", "softmax": "softmax", "sigmoid": "sigmoid"}
ACT_MODULES = {"torch.nn.LogSoftmax": "log_softmax", "torch.nn.Softmax": "softmax", "torch.nn.Sigmoid": "sigmoid"}
ACTS = frozenset(ACT_METHODS.values())
F_LOSSES = frozenset("""cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss ctc_loss margin_ranking_loss
    hinge_embedding_loss multilabel_margin_loss soft_margin_loss multilabel_soft_margin_loss
    cosine_embedding_loss multi_margin_loss triplet_margin_loss triplet_margin_with_distance_loss""".split())
TENSOR_FUNCS = frozenset("""tensor as_tensor asarray from_numpy frombuffer zeros ones empty full rand randn randint
    randperm arange linspace logspace eye zeros_like ones_like empty_like full_like rand_like randn_like
    randint_like normal bernoulli multinomial stack cat concat concatenate hstack vstack dstack matmul mm bmm
    einsum exp log log1p sqrt rsqrt abs sum mean std var prod where clamp clip tanh relu max min amax amin
    argmax argmin sort topk gather index_select masked_select norm cdist pow square add sub mul div
    flatten reshape transpose permute squeeze unsqueeze chunk split tensor_split roll flip cumsum
    outer dot baddbmm addmm conv2d softmax log_softmax sigmoid
    Tensor FloatTensor LongTensor IntTensor ByteTensor BoolTensor DoubleTensor HalfTensor""".split())
NON_TENSOR_METHODS = frozenset("""item tolist numpy size dim ndimension numel element_size nelement
    data_ptr is_contiguous is_floating_point storage untyped_storage stride get_device backward
    register_hook __len__ type""".split())
VIEW_METHODS = frozenset("""view reshape flatten squeeze unsqueeze permute transpose contiguous float double
    half bfloat16 to cuda cpu type_as view_as reshape_as narrow""".split())
MODULE_SELF_METHODS = frozenset("""to cuda cpu half float double bfloat16 train eval requires_grad_
    share_memory apply type to_empty xpu ipu mtia""".split())
SHAPE_METHODS = frozenset("view reshape unsqueeze squeeze permute transpose size dim numel contiguous flatten"
                          .split())
MODULE_ONLY_METHODS = frozenset("""eval parameters named_parameters modules named_modules children named_children
    buffers named_buffers register_forward_hook register_forward_pre_hook register_full_backward_hook""".split())
MOVE_METHODS = frozenset("cuda cpu to half float double bfloat16 long int short byte char bool pin_memory type"
                         .split())
STATELESS_MODULES = frozenset("torch.nn." + n for n in """ReLU ReLU6 LeakyReLU GELU SiLU Mish ELU CELU SELU
    Tanh Sigmoid Hardtanh Hardswish Hardsigmoid Softplus Softsign Softshrink Hardshrink Tanhshrink LogSigmoid
    Softmax LogSoftmax Softmin Softmax2d Threshold GLU Identity Flatten Unflatten MaxPool1d MaxPool2d
    MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d
    AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d LPPool1d LPPool2d Upsample UpsamplingNearest2d
    UpsamplingBilinear2d PixelShuffle PixelUnshuffle ChannelShuffle ZeroPad2d ConstantPad1d ConstantPad2d
    ConstantPad3d ReflectionPad1d ReflectionPad2d ReplicationPad1d ReplicationPad2d""".split())
PARAMETER_FREE_MODULES = STATELESS_MODULES | frozenset("torch.nn." + n for n in """Dropout Dropout1d Dropout2d
    Dropout3d AlphaDropout FeatureAlphaDropout""".split())
# Layers of other libraries that hold no parameters, recognised by their class name (timm's DropPath and
# DropBlock2d, torchvision's StochasticDepth): calling one records no graph worth a no_grad.
PARAMETER_FREE_NAME = re.compile(r"^(Drop\w*|\w*Dropout\w*|StochasticDepth|Identity)$")
RNN_MODULES = frozenset({"torch.nn.RNN", "torch.nn.LSTM", "torch.nn.GRU"})
CONTAINERS = frozenset({"torch.nn.ModuleList", "torch.nn.ModuleDict", "torch.nn.Sequential",
                        "torch.nn.ParameterList", "torch.nn.ParameterDict"})
DROPOUT_FNS = frozenset("torch.nn.functional." + n for n in
                        "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout".split())
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})
CLOCKS = frozenset({"time.time", "time.perf_counter", "time.monotonic", "time.time_ns",
                    "time.perf_counter_ns", "time.monotonic_ns", "timeit.default_timer"})
SYNC_FUNCS = frozenset({"torch.cuda.synchronize", "torch.cuda.current_stream", "torch.cuda.default_stream",
                        "torch.cuda.Event", "torch.cuda.Stream", "torch.accelerator.synchronize",
                        "torch.mps.synchronize", "torch.xpu.synchronize", "torch.distributed.barrier"})
SYNC_METHODS = frozenset("synchronize item tolist numpy cpu elapsed_time wait".split())
SAFE_BUILTINS = frozenset("""range len enumerate zip list dict tuple set str repr isinstance issubclass min
    max sum abs round sorted reversed iter next getattr setattr hasattr super type format any all map filter
    divmod hash id""".split())
TQDM = frozenset({"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.trange"})
_SAME_ELEMENTS = TQDM | {"iter", "tqdm"}  # iter(x), tqdm(x): the elements of x
LOADERISH = re.compile(r"(?:^|_)(?:data)?loader$|^dl$|_dl$", re.IGNORECASE)
DATALOADER = "torch.utils.data.DataLoader"
WRAPPERS = frozenset({"torch.nn.DataParallel", "torch.nn.DistributedDataParallel", "torch.compile"})
RENAMED = {"torch.nn.functional.sigmoid": "torch.sigmoid", "torch.special.expit": "torch.sigmoid",
            "torch.serialization.load": "torch.load", "torch.autograd.no_grad": "torch.no_grad",
            "torch.autograd.grad_mode.no_grad": "torch.no_grad",
            "torch.autograd.inference_mode": "torch.inference_mode",
            "torch.autograd.grad_mode.inference_mode": "torch.inference_mode",
            "torch.autograd.set_grad_enabled": "torch.set_grad_enabled",
            "torch.autograd.grad_mode.set_grad_enabled": "torch.set_grad_enabled",
            "torch.autograd.enable_grad": "torch.enable_grad", "torch.nn.parameter.Parameter": "torch.nn.Parameter",
            "tqdm.auto.trange": "tqdm.trange"}


def canon(q: str | None) -> str | None:
    """One spelling per torch object: ``torch.nn.modules.loss.CrossEntropyLoss`` is
    ``torch.nn.CrossEntropyLoss``, ``torch.utils.data.dataloader.DataLoader`` is
    ``torch.utils.data.DataLoader``."""
    if q is None:
        return None
    parts = q.split(".")
    home = _public_home(q, parts) if parts[-1][:1].isupper() else None
    return f"{home}.{parts[-1]}" if home is not None else RENAMED.get(q, q)


def is_torch_nn_class(q: str | None) -> bool:
    return bool(q) and q.startswith("torch.nn.") and q.count(".") == 2 and q[9:10].isupper()


def is_loss(q: str | None) -> bool:
    return bool(q) and ((is_torch_nn_class(q) and q.endswith("Loss"))
                        or (q.startswith("torch.nn.functional.") and q[20:] in F_LOSSES))


def _public_home(q: str, parts: list[str]) -> str | None:
    """The package that exports the class ``q`` names by its defining module (``torch.nn`` for
    ``torch.nn.modules.loss.CrossEntropyLoss``); None when ``q`` is spelled as exported."""
    if q.startswith("torch.nn."):
        return "torch.nn" if _exported_by_nn(q, parts) else None
    if q.startswith("torch.utils.data.") and parts[-1] == "DataLoader":
        return "torch.utils.data"
    if q.startswith("torch.optim.") and len(parts) == 4 and parts[2] not in ("lr_scheduler", "swa_utils"):
        return "torch.optim"  # torch.optim.adamw.AdamW; a scheduler keeps its module
    return None


def _exported_by_nn(q: str, parts: list[str]) -> bool:
    """A class of ``torch.nn.modules.*``, or DataParallel/DDP of ``torch.nn.parallel.*``."""
    return ((q.startswith("torch.nn.modules.") and len(parts) >= 4)
            or (q.startswith("torch.nn.parallel.") and parts[-1] in ("DataParallel", "DistributedDataParallel")))
