"""What a training checkpoint records of the recipe that wrote it, compared with the recipe that reads it,
before any process group: the architecture (options that hold no weight), a Wan 2.2 expert's timesteps,
the parameters trained, and the frozen encoders. Each difference is refused by name with what to do;
checkpoints written before a record existed are not checked on it.
"""

from parallel.checkpoints.checkpoint_files import CheckpointError
from parallel.checkpoints.checkpoint_reading import read_trainer_state


def check_architecture(path, architecture: dict) -> None:
    """Refuse a checkpoint trained with another DiT (DiT.architecture(), recorded at save). Loading catches
    differences of shape; this also catches the options that hold no weight (model.absolute_positions,
    model.text_mask, model.rope_theta), which would load silently and sample nonsense. Checkpoints from
    before the architecture was recorded are not checked, nor entries added to it since."""
    saved = read_trainer_state(path).get("architecture")
    if saved is None:
        return
    from models.dit.transformer import architecture_differences, recipe_key

    differs = [
        f"{recipe_key(k)}: {k}={saved[k]!r} there, {architecture[k]!r} here"
        for k in architecture_differences(architecture, saved)
    ]
    if differs:
        raise CheckpointError(
            f"checkpoint {path} was trained with another model: {'; '.join(differs)}. Use the recipe "
            f"it was trained with (its run's config.yaml), or set these keys to match"
        )


def expert_record(cfg) -> dict:
    """What trainer_state.pt says of the timesteps a run trains (Wan 2.2 A14B, model.expert=high|low: one
    expert's side of sample.boundary; none: all of them, whatever the boundary)."""
    expert = cfg.model.expert
    return {"expert": expert, "boundary": cfg.sample.boundary if expert != "none" else None}


def check_expert(path, record: dict) -> None:
    """Refuse to resume an expert's checkpoint on other timesteps (another model.expert, or another
    sample.boundary): it would train one expert's weights on the other's noise levels, silently.
    Checkpoints from before the record was kept resume as they did."""
    saved = read_trainer_state(path).get("expert")
    if saved is None or saved == record:
        return

    def recipe(r: dict) -> str:
        boundary = "" if r["boundary"] is None else f" sample.boundary={r['boundary']}"
        return f"model.expert={r['expert']}{boundary}"

    raise CheckpointError(
        f"checkpoint {path} trained {recipe(saved)}, this run has {recipe(record)}: resuming would train "
        f"its weights on other timesteps. Keep the checkpoint's values ({recipe(saved)}), or train "
        f"this recipe elsewhere (another run.output_dir, or train.resume=none)"
    )


def check_trained(path, record: dict) -> None:
    """Refuse to resume a checkpoint whose recipe trained other parameters (models/family.py
    training_record: LTX-2's data.audio): its optimizer holds state for another set, and the weights it
    froze would start training (or the reverse). Checkpoints without the record resume as they did."""
    saved = read_trainer_state(path).get("trained", {})
    differs = [
        f"{key}={saved[key]} there, {value} here"
        for key, value in record.items()
        if saved.get(key, value) != value
    ]
    if differs:
        raise CheckpointError(
            f"checkpoint {path} trained other parameters ({'; '.join(differs)}): keep the checkpoint's "
            "values, or train this recipe elsewhere (another run.output_dir, or train.resume=none)"
        )


def check_encoders(path, record: dict) -> None:
    """Refuse to resume a checkpoint trained with other frozen encoders (data/latents.py encoder_record: the
    VAE, text encoder and image encoder, their settings and their weights' fingerprints): the transformer
    learnt their latents and embeddings, and other weights of the same shapes would load silently, as
    precomputed latents already refuse. Checkpoints without the record resume as they did."""
    saved = read_trainer_state(path).get("encoders")
    if saved is None:
        return

    def shown(value) -> str:
        return f"{value['folder']} (weights {value['weights']})" if isinstance(value, dict) else repr(value)

    def same(a, b) -> bool:  # a folder by its weights: moved elsewhere, it is the same
        if isinstance(a, dict) and isinstance(b, dict):
            return a["weights"] == b["weights"]
        if isinstance(a, dict) or isinstance(b, dict):  # one side's folder is gone: judged by its path
            return (a["folder"] if isinstance(a, dict) else a) == (b["folder"] if isinstance(b, dict) else b)
        return a == b

    differs = [
        f"{key}: {shown(saved[key])} there, {shown(value)} here"
        for key, value in record.items()
        if key in saved and not same(saved[key], value)
    ]
    if differs:
        raise CheckpointError(
            f"checkpoint {path} was trained with other frozen encoders ({'; '.join(differs)}): its "
            "transformer learnt their latents and text embeddings. Point these keys at the encoders it was "
            "trained with, or train this recipe elsewhere (another run.output_dir, or train.resume=none)"
        )
