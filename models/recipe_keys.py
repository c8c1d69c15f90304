"""Recipe keys that belong to a family (its models/<family>/keys.py declares them: a light module, read
without importing the family). configs/schema.py adds them to their sections, so they load, merge and
type-check like every key and keep their spelling; configs/ refuses one set (to other than its default)
under a family that does not read it, by name, before anything starts."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RecipeKey:
    key: str  # section.name, e.g. "sample.stg"
    type: object  # its annotation, e.g. Optional[float]
    default: object
    families: tuple  # the model.family names that read it
    what: str = "key"  # how a refusal names it, e.g. "guidance term"
    choices: tuple = ()  # its allowed values (configs/ CHOICES), if a choice
    at_least: int | None = None  # its least value, else null (configs/ NULL_OR), if a bounded count
    null: str = "its default"  # what null means, for that bound's message

    @property
    def section(self) -> str:
        return self.key.split(".")[0]

    @property
    def name(self) -> str:
        return self.key.split(".", 1)[1]
