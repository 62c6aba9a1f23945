import torch
import torch.backends.cudnn as cudnn


def seed_torch(seed=1029):  # the seeds' helper: determinism and no benchmarking
    torch.manual_seed(seed)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def configure(args):
    if args.deterministic:
        cudnn.deterministic = True
        cudnn.benchmark = False
    else:
        cudnn.benchmark = True


def configure_flag(args):
    cudnn.deterministic = args.deterministic
    cudnn.benchmark = not args.deterministic


def fast():  # a helper of its own, never called next to the deterministic one
    torch.backends.cudnn.benchmark = True


def reproducible():
    torch.use_deterministic_algorithms(True)


def switched_back():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
