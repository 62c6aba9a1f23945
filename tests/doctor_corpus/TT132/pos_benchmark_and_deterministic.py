import random

import numpy as np
import torch
import torch.backends.cudnn as cudnn


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = True  # expect: TT132


def main(args):
    torch.use_deterministic_algorithms(True)
    setup()


def setup():
    cudnn.benchmark = True  # expect: TT132


if __name__ == "__main__":
    main(None)
