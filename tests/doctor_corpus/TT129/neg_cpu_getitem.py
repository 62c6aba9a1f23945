import torch
from torch.utils.data import DataLoader, Dataset

device = torch.device("cuda")


class Images(Dataset):  # CPU tensors from the workers, moved in the loop
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return torch.load(self.paths[i], map_location="cpu", weights_only=True)


loader = DataLoader(Images(["a.pt"]), batch_size=32, num_workers=4, pin_memory=True)
for x in loader:
    x = x.to(device, non_blocking=True)


class OnDevice(Dataset):  # CUDA in __getitem__, but loaded in the main process (num_workers=0)
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i].cuda()


main_process = DataLoader(OnDevice(torch.randn(10, 3)), batch_size=2)
explicit_zero = DataLoader(OnDevice(torch.randn(10, 3)), batch_size=2, num_workers=0)


class Configurable(Dataset):  # a device attribute that the class sets to the CPU
    def __init__(self, data):
        self.data = data
        self.device = "cpu"

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i].to(self.device)


configured = DataLoader(Configurable(torch.randn(10, 3)), batch_size=2, num_workers=2)


class Prefetcher:  # not a Dataset: moves whole batches after the loader
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for x in self.loader:
            yield x.cuda(non_blocking=True)


prefetched = Prefetcher(DataLoader(Images(["b.pt"]), num_workers=8))


class Cached(Dataset):  # CUDA work in __init__ only (the main process); samples indexed on the host
    def __init__(self, data):
        self.data = data.cuda().mean(0).cpu()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


cached = DataLoader(Cached(torch.randn(10, 3)), num_workers=2)
