import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

device = torch.device("cuda")


class Images(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        x = torch.load(self.paths[i], map_location="cpu", weights_only=True)
        return x.cuda()  # expect: TT129


loader = DataLoader(Images(["a.pt"]), batch_size=32, num_workers=4, pin_memory=True)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.randn(3, 32, 32, device="cuda")  # expect: TT129
        return x, i


def make_loader(args):
    dataset = Pairs(100)
    return DataLoader(dataset, batch_size=8, shuffle=True, num_workers=args.workers)


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(100):
            yield torch.full((4,), float(i)).to(device)  # expect: TT129


stream = DataLoader(Stream(), batch_size=4, num_workers=2)
