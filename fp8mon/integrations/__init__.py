"""Callbacks that attach the fp8mon Agent to a framework's trainer, one module per framework::

    from fp8mon.integrations.hf import Fp8monCallback         # transformers.Trainer(..., callbacks=[...])
    from fp8mon.integrations.lightning import Fp8monCallback  # lightning.pytorch.Trainer(callbacks=[...])

Importing this package imports no framework; each module needs its own (``pip install 'fp8mon[hf]'`` or
``'fp8mon[lightning]'``) and says so when it is missing.
"""

__all__: list[str] = []
