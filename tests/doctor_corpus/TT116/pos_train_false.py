def predict(model, batches):
    model.train(False)
    outputs = []
    for batch in batches:
        outputs.append(model(batch))  # expect: TT116
    return outputs
