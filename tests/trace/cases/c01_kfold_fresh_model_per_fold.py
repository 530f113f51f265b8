"""K-fold cross-validation: a fresh model and optimizer per fold (correct; nothing to report).

Source: https://py4u.org/questions/75264251/ (BERT k-fold: re-create the model for each fold)
"""
# case: {"kind": "clean", "exit": 0}
import torch
import torch.nn as nn
from transformers import BertConfig, BertForSequenceClassification


def train_fold(fold, data):
    torch.manual_seed(fold)
    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                     intermediate_size=64, vocab_size=128, num_labels=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids, labels in data:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(loss)


def main():
    data = [(torch.randint(0, 128, (4, 10)), torch.randint(0, 2, (4,))) for _ in range(6)]
    folds = 3
    for fold in range(folds):
        train = [batch for i, batch in enumerate(data) if i % folds != fold]
        print("fold", fold, "loss", train_fold(fold, train))


main()
