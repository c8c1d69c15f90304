import pytest

from configs import CONFIG_DIR, ConfigError, load_config, split_overrides
from configs.schema import TesseraConfig

RECIPES = sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.glob("**/*.yaml"))  # configs/cards/ too


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_loads(recipe):
    cfg = load_config(CONFIG_DIR / recipe)
    assert cfg.train.max_steps >= 1


def test_a_recipe_on_a_base_takes_the_bases_keys_and_overrides_them(tmp_path):
    """`base:` (relative to the recipe's folder) is merged first, the recipe's keys and then the command
    line's on top; a base's misspelt key names the base's file; a circle of bases is named."""
    (tmp_path / "cards").mkdir()
    (tmp_path / "base.yaml").write_text("train:\n  max_steps: 3\n  lr: 0.5\ndata:\n  frame_counts: [1, 5]\n")
    card = tmp_path / "cards" / "card.yaml"
    card.write_text("base: ../base.yaml\ntrain:\n  lr: 0.25\ndata:\n  frame_counts: [1]\n")
    cfg = load_config(card, ["train.max_steps=4"])
    assert (cfg.train.max_steps, cfg.train.lr, list(cfg.data.frame_counts)) == (4, 0.25, [1])
    assert load_config(card).train.max_steps == 3
    (tmp_path / "base.yaml").write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_step' in recipe '.*base.yaml'"):
        load_config(card)
    (tmp_path / "base.yaml").write_text("base: cards/card.yaml\n")
    with pytest.raises(ConfigError, match="is its own base"):
        load_config(card)
    card.write_text("base: ../missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml' does not exist"):
        load_config(card)


def test_overrides_come_last_and_keep_types():
    cfg = load_config(
        None, ["train.max_steps=7", "train.lr=0.5", "model.patch_size=[1,2,2]", "data.manifest=x.jsonl"]
    )
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.lr == 0.5
    assert list(cfg.model.patch_size) == [1, 2, 2]
    assert cfg.data.manifest == "x.jsonl"
    # untouched keys keep the schema default
    assert cfg.train.ema_decay == load_config(None).train.ema_decay


def test_recipe_holds_only_differences(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_steps: 3\n")
    cfg = load_config(recipe)
    assert cfg.train.max_steps == 3
    assert cfg.train.batch_size == TesseraConfig().train.batch_size


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_step=5", "did you mean 'train.max_steps'"),
        ("trian.max_steps=5", "did you mean 'train.max_steps'"),
        ("parallel.ulysess=2", "did you mean 'parallel.ulysses'"),
    ],
)
def test_misspelt_key_names_the_closest(override, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        load_config(None, [override])
    assert override.split("=")[0] in str(e.value)


def test_misspelt_key_in_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  checkpoint_evry: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.checkpoint_evry'.*'train.checkpoint_every'"):
        load_config(recipe)


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("train.max_steps=abc", "train.max_steps", "int"),
        ("train.lr=fast", "train.lr", "float"),
        ("logging.wandb=maybe", "logging.wandb", "bool"),
    ],
)
def test_wrong_type_names_key_and_type(override, key, expected):
    with pytest.raises(ConfigError, match=rf"'{key}'.*must be {expected}"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("vae.kind=vqgan", "choose one of identity, kl, wan"),
        ("model.size=DiT-huge", "choose one of DiT-tiny"),
        ("train.batch_size=0", "at least 1"),
        ("model.patch_size=[1,2]", "three positive sizes"),
        ("train", "not of the form key=value"),
        ("data.max_missing_fraction=1.5", r"'data.max_missing_fraction' must be in \[0, 1\], got 1.5"),
        ("train.loss_limit=0", "'train.loss_limit' must be greater than 0"),
    ],
)
def test_bad_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_recipe():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_split_overrides_leaves_prompts_alone():
    args, overrides = split_overrides(
        ["--prompt", "a red square", "x = y", "parallel.dp=2", "--frames", "9", "lr=1"]
    )
    assert overrides == ["parallel.dp=2", "lr=1"]
    assert args == ["--prompt", "a red square", "x = y", "--frames", "9"]


def test_key_without_section_names_the_full_key():
    with pytest.raises(ConfigError, match="unknown key 'max_steps'.*did you mean 'train.max_steps'"):
        load_config(None, ["max_steps=5"])


@pytest.mark.parametrize(
    "override", ["data.fps=0", "sample.fps=0", "flow.shift_reference_tokens=-1", "train.grad_clip=0"]
)
def test_values_that_would_divide_by_zero_or_stall(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_learning_rate_warms_up_then_stays_or_follows_a_cosine_to_zero():
    import train

    constant = load_config(  # named: the default recipe (the demo's) cools down
        overrides=["train.lr=1e-3", "train.warmup_steps=10", "train.max_steps=110", "train.lr_decay=constant"]
    )
    cosine = load_config(
        overrides=["train.lr=1e-3", "train.warmup_steps=10", "train.max_steps=110", "train.lr_decay=cosine"]
    )
    for cfg in (constant, cosine):
        assert train.learning_rate(cfg.train, 0) == pytest.approx(1e-4)  # warm-up is the same for both
        assert train.learning_rate(cfg.train, 10) == pytest.approx(1e-3)
    assert train.learning_rate(constant.train, 109) == pytest.approx(1e-3)
    assert train.learning_rate(cosine.train, 60) == pytest.approx(5e-4)  # half way down
    assert train.learning_rate(cosine.train, 109) < 1e-6 and train.learning_rate(cosine.train, 500) == 0.0
    with pytest.raises(ConfigError, match="'train.lr_decay' is 'step'; choose one of constant, cosine, lin"):
        load_config(overrides=["train.lr_decay=step"])


def test_linear_decay_holds_the_rate_then_goes_straight_to_zero():
    """train.lr_decay=linear (warm-up, constant, then down to 0 over the last decay_fraction of the steps:
    the demo's 'cooldown')."""
    import train

    cfg = load_config(
        overrides=["train.lr=1e-3", "train.warmup_steps=10", "train.max_steps=110", "train.lr_decay=linear",
                   "train.decay_fraction=0.5"]
    )  # fmt: skip
    rates = [train.learning_rate(cfg.train, step) for step in range(120)]
    assert rates[0] == pytest.approx(1e-4) and rates[10] == pytest.approx(1e-3)
    assert rates[55] == pytest.approx(1e-3)  # 55 steps left: the last half starts here
    assert rates[82] == pytest.approx(1e-3 * 28 / 55)  # straight down
    assert rates[109] == pytest.approx(1e-3 / 55) and min(rates) == 0.0 == rates[119]
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="train.decay_fraction"):
            load_config(overrides=[f"train.decay_fraction={bad}"])


def test_decay_fraction_without_the_linear_decay_is_refused(tmp_path):
    """train.decay_fraction asked for on the command line where lr_decay is not linear would do nothing:
    refused by name. A run's config.yaml (every key, whatever its lr_decay) still loads as a recipe."""
    from configs import save_config

    with pytest.raises(ConfigError, match="train.decay_fraction=0.3 on the command line.*'cosine'"):
        load_config(overrides=["train.lr_decay=cosine", "train.decay_fraction=0.3"])
    with pytest.raises(ConfigError, match="'train.lr_decay' is 'Linear'; choose one of"):  # the choice first
        load_config(overrides=["train.lr_decay=Linear", "train.decay_fraction=0.3"])
    assert load_config(overrides=["train.decay_fraction=0.3"]).train.decay_fraction == 0.3  # demo: linear
    for recipe, overrides in ((None, ["train.lr_decay=constant"]), (CONFIG_DIR / "video.yaml", [])):
        save_config(load_config(recipe, overrides), tmp_path / "config.yaml")
        assert load_config(tmp_path / "config.yaml").train.lr_decay != "linear"


def test_checkpoint_policy_is_refused_where_it_cannot_run():
    """train.checkpoint_policy=selective names its missing switch, and an attention backend whose outputs
    it cannot keep, before start-up."""
    selective = ["train.activation_checkpointing=true", "train.checkpoint_policy=selective"]
    with pytest.raises(ConfigError, match="set train.activation_checkpointing=true too"):
        load_config(CONFIG_DIR / "demo.yaml", ["train.checkpoint_policy=selective"])
    with pytest.raises(ConfigError, match="choose one of all, selective"):
        load_config(CONFIG_DIR / "demo.yaml", ["train.checkpoint_policy=some"])
    with pytest.raises(ConfigError, match="not model.attention_backend=flash's"):
        load_config(CONFIG_DIR / "demo.yaml", [*selective, "model.attention_backend=flash"])
    assert load_config(CONFIG_DIR / "demo.yaml", selective).train.checkpoint_policy == "selective"
