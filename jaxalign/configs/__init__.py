"""Training configs (ml_collections ``get_config()`` files): ``jaxalign train --config NAME_OR_PATH``."""
