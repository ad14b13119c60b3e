"""Checkpoints: the sharded format (``sharded.py``, names in ``format.py``, manifest checks
in ``validate.py``), saved and loaded over the ranks (``distributed.py``); the single-file
``final.h5`` (``single_file.py``); ``hpctrain ckpt`` (``ckpt_commands.py``, ``export.py``,
``hf_import.py``, with the Hugging Face layout in ``hf_names.py`` and ``hf_config.py``);
weights alone from any checkpoint (``weights.py``) and ``--train.init_from``
(``init_from.py``)."""
