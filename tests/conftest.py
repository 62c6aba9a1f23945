import os

import pytest
import torch

# Two cores: keep intra-op threads bounded so parallel pytest runs (if any) don't thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
