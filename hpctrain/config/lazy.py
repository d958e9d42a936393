"""Optional sections whose models are built on first use.

Building a pydantic model is most of what `hpctrain validate` spends beyond importing pydantic (issue 23
item 8: ~0.7 ms a model, ~60 us a field). A few optional sections are absent from most jobs and live in
modules of their own: `kubernetes` (3 models), `entrypoint`, `model.moe` (2), `train.lora`. Their fields are
typed `Optional[LazySection(...)]`: the section's module is imported, and its models built, when a job
has the section (or when something asks for the model). The field validates with the model's own
`model_validate`: the same strictness and the same errors, under the field's location (pydantic-core takes a
ValidationError raised in a validator as the nested errors it holds); it dumps as the model does (pydantic
serialises a value of an unknown type by its own type). `hpctrain schema` writes the model in its place
(`SchemaGenerator`): a `$ref` to its definition, as a plain model field gives.

mypy sees the model class (each field's type is an alias that names the class under TYPE_CHECKING).
"""

import sys
from importlib import import_module
from typing import Any, Optional

from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from hpctrain.config.plugins_off import collector_paused, pydantic_plugins_off

_KEY = "hpctrain_lazy_section"  # where a lazy field's core schema keeps its LazySection (the schema's metadata)


class LazySection:
    """`Annotated[Any, LazySection("hpctrain.config.moe", "MoEConfig")]`: that model, built on first use."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def model(self) -> type[BaseModel]:
        module = sys.modules.get(self.module)
        if module is None:  # built as the schema's other models are (config/__init__.py, config/plugins_off.py)
            with pydantic_plugins_off(), collector_paused():
                module = import_module(self.module)
        model: type[BaseModel] = getattr(module, self.name)
        return model

    def validate(self, value: Any) -> Any:
        model = self.model()
        return value if isinstance(value, model) else model.model_validate(value)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate, metadata={_KEY: self})


def _lazy_of(schema: Any) -> Optional[LazySection]:
    metadata = schema.get("metadata") if isinstance(schema, dict) else None
    found = metadata.get(_KEY) if isinstance(metadata, dict) else None
    return found if isinstance(found, LazySection) else None


def lazy_model(annotation: Any) -> Optional[type[BaseModel]]:
    """The model behind a field annotation that is, or holds, a LazySection (`Optional[...]` too); else None."""
    for arg in (annotation, *(getattr(annotation, "__args__", ()) or ())):
        for meta in getattr(arg, "__metadata__", ()):
            if isinstance(meta, LazySection):
                return meta.model()
    return None


class SchemaGenerator(GenerateJsonSchema):
    """pydantic's JSON schema generator, writing each lazy section as its model: the JSON schema of the job is
    the one of the same fields typed with the models themselves."""

    def function_plain_schema(self, schema: core_schema.PlainValidatorFunctionSchema) -> JsonSchemaValue:
        lazy = _lazy_of(schema)
        if lazy is None:
            return super().function_plain_schema(schema)
        return self.generate_inner(lazy.model().__pydantic_core_schema__)

    def field_title_should_be_set(self, schema: Any) -> bool:
        # A field holding a model has no title of its own (the model's definition has one); so for these.
        if _lazy_of(schema) is not None:
            return False
        return super().field_title_should_be_set(schema)
