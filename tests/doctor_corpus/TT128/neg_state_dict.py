import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

torch.save(model.state_dict(), "model.pt")
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, "ckpt.pt")
torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(), "weights.pt")
torch.save(torch.randn(3, 4), "tensor.pt")
torch.save([torch.zeros(2), torch.ones(2)], "tensors.pt")

scripted = torch.jit.script(model)
torch.jit.save(scripted, "scripted.pt")
scripted.save("scripted2.pt")
torch.save(scripted, "scripted3.pt")  # a ScriptModule: its code travels with it

traced = torch.jit.trace(model, torch.randn(1, 4))
torch.jit.save(traced, "traced.pt")


def save_checkpoint(state, path):
    torch.save(state, path)  # whatever the caller built: a dict


def save_classifier(features, labels, path):
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression().fit(features, labels)  # not an nn.Module: nothing shows it is one
    torch.save(clf, path)
    encoder = load_encoder()
    encoder.eval()
    encoder = torch.jit.script(encoder)  # rebound to the scripted module
    torch.save(encoder, path + ".enc")
