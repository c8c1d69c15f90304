"""How a family trains (Family.objective), declared as one object the training loop and the distillation
call: each sample's noise and sigma, the loss of a batch and the training transformer's velocity, and the
distillation recipes the model cannot take. The default is the flow matching of models/flow.py on the
velocity; a family subclasses it where its model differs (its sound, its timestep convention, its image
condition, a guidance input)."""

import torch


class Objective:
    def draw(self, parts, flow, x0, cond, generators: list) -> tuple:
        """(noise, sigmas) of a training batch, sample i's from generators[i] alone (so that they do not
        depend on the batch, the rank or the layout): models/flow.py's draw, one sigma per sample."""
        return flow.draw(x0.shape[1:], generators)

    def loss(self, parts, flow, model, x0, cond, noise, t) -> torch.Tensor:
        """The loss of a training batch on the training transformer `model`: the flow-matching loss of
        models/flow.py on its velocity (draw's noise and sigmas)."""
        velocity = lambda x, s, c, _: self.velocity(parts, model, x, s, c)  # noqa: E731
        return flow.training_loss(velocity, x0, cond, None, noise, t)

    def velocity(self, parts, model, x, sigma, cond):
        """The training transformer's velocity (noise - x0) at x = (1 - sigma) x0 + sigma noise, sigma (B,)
        in [0, 1], as its loss takes it (distillation's predictions: parallel/drive/distill.py)."""
        return model(x, sigma, cond)

    def check_distillation(self, cfg) -> None:
        """Refuse (ValueError) by name a recipe whose distillation (train.objective=dmd) it cannot take."""
