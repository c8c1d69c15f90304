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

    # a distillation's pieces (parallel/drive/distill.py): the student walks the noise in the form that
    # sampling walks (`student_noise`), with one pass a step; the teacher guides as the family's pipeline; the
    # critic learns the student's samples with the training's loss. The default: the training's velocity, on
    # the latents as they train, guided by the family's formula.
    def student_noise(self, parts, x0, cond, noise):
        """The noise (from draw) the student's sampling starts from."""
        return noise.to(x0.device, x0.dtype)

    def student_velocity(self, family, parts, model, x, sigma, cond):
        """The student's (or the critic's) velocity at x, sigma (B,): one pass of `model`."""
        return self.velocity(parts, model, x, sigma, cond)

    def teacher_velocity(self, family, parts, model, x, sigma, cond, uncond, scale: float):
        """The frozen teacher's velocity at x, sigma (B,), guided at `scale` as the family samples."""
        v = self.velocity(parts, model, x, sigma, cond)
        if family.guidance.guided(scale):
            v = family.guidance.guide(v, self.velocity(parts, model, x, sigma, uncond), scale, parts)
        return v

    def sample_loss(self, parts, flow, model, sample, cond, noise, sigma) -> torch.Tensor:
        """The training's loss on the student's `sample` (the critic's), at `noise` and sigma (B,)."""
        return self.loss(parts, flow, model, sample, cond, noise, sigma)

    def check_distillation(self, cfg) -> None:
        """Refuse (ValueError) by name a recipe whose distillation (train.objective=dmd) it cannot take."""
