import torch

x = torch.randn(3, 4)
x.cuda()  # expect: TT113
x.to("cuda:0")  # expect: TT113
mask = torch.zeros(3, dtype=torch.bool)
mask.float()  # expect: TT113


def train(model, loader, device):
    for images, labels in loader:
        images.to(device)  # expect: TT113
        labels.cuda(non_blocking=True)  # expect: TT113
        model(images)


for batch in train_loader:
    batch["image"].cuda()  # expect: TT113

w = torch.nn.Parameter(torch.ones(2))
w.half()  # expect: TT113
