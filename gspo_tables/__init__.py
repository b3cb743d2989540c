"""The extension points' one shape, at the bottom of the house beside the error base: a `Table` of
rows, open to rows from installed modules outside the package (`package.module:Name`, or a
`plugins:` module that registers its rows), each row owning its settings, built from plain data.

    from gspo_tables import Table, build, row_settings
    LOSSES = Table("loss", LossSpec, rows, field="loss.name")   # table.py
    settings = row_settings(LOSSES["gspo"], {}, "loss.loss_args")  # settings.py

Every table of the project is one of these (losses, aggregations, KL estimators, advantage
estimators, transports, rewards, environments, families, prompt formats); `TABLES` holds each
once its module is imported. Imports nothing of the project but gspo_errors, and no torch.
"""
from gspo_tables.settings import (CHECK, CHOICES_LABEL, CHOOSE, SETTINGS_OF, TABLE, ConfigError, build, field_docs, row_settings,
                                  section_types, settings_fields, type_name)
from gspo_tables.table import TABLES, Table, TableError, import_plugins, is_reference, load_object

__all__ = ["CHECK", "CHOICES_LABEL", "CHOOSE", "ConfigError", "SETTINGS_OF", "TABLE", "TABLES", "Table", "TableError", "build",
           "field_docs", "import_plugins", "is_reference", "load_object", "row_settings", "section_types",
           "settings_fields", "type_name"]
