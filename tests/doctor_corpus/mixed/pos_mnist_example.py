"""The PyTorch MNIST example with the classic pitfalls put in: each rule must find its line."""
import argparse
import time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torchvision import datasets, transforms


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = torch.flatten(x, 1)
        x = F.dropout(x, 0.25)  # expect: TT102
        x = self.fc2(F.relu(self.fc1(x)))
        output = F.log_softmax(x, dim=1)
        return output


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    epoch_loss = 0
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)  # expect: TT106
        loss.backward()
        optimizer.step()
        epoch_loss += loss  # expect: TT117
        torch.cuda.empty_cache()  # expect: TT115
    return epoch_loss


def test(model, device, test_loader):
    model.eval()
    correct = 0
    for data, target in test_loader:
        data, target = data.to(device), target.to(device)
        output = model(data)  # expect: TT116
        pred = output.argmax(dim=1, keepdim=True)
        correct += pred.eq(target.view_as(pred)).sum().item()
    return correct


def main():
    parser = argparse.ArgumentParser()
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_loader = torch.utils.data.DataLoader(  # expect: TT120, TT121
        datasets.MNIST('../data', train=True, download=True, transform=transforms.ToTensor()),
        batch_size=64, shuffle=True)
    test_loader = torch.utils.data.DataLoader(  # expect: TT120
        datasets.MNIST('../data', train=False, transform=transforms.ToTensor()), batch_size=1000)
    model = Net().to(device)
    model = nn.DataParallel(model)  # expect: TT114
    optimizer = optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)  # expect: TT119
    for epoch in range(1, 3):
        start = time.time()
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        print(time.time() - start)
    torch.save(model.state_dict(), "mnist_cnn.pt")
    model.load_state_dict(torch.load("mnist_cnn.pt"))  # expect: TT110, TT111


if __name__ == "__main__":
    main()
