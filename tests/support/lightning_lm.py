"""The one-layer language model the Lightning tests fit on the CPU (and the GPU test on a GPU): an embedding and a
linear head over token ids, seeded so that two fits start from the same weights. A test's subclass says how its
step runs (`training_step`) and what it records; `lm_loss` is the next-token loss of a batch `(ids,)`, its logits
in fp32 under any autocast. Import it only after `pytest.importorskip("lightning")`."""

from __future__ import annotations

import lightning as L
import torch


class TinyLM(L.LightningModule):
    vocab, width, lr = 64, 16, 0.1

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(self.vocab, self.width), torch.nn.Linear(self.width, self.vocab))

    def lm_loss(self, batch) -> torch.Tensor:
        ids = batch[0]
        logits = self.net(ids[:, :-1]).reshape(-1, self.vocab).float()
        return torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
