"""TEST AND DEVELOPMENT ONLY: stand-ins for what this machine lacks, kept out of the product.

* ``fake_deepinfer``: DeepInfer's Python API with a toy SM100 forward (in-process, one rank),
  optionally over the installed DeepInfer's compiled scheduler (``core="installed"``);
* ``fake_deepinfer_lockstep``: the same as a group of rank processes. The rank worker imports it
  for engine ``deepinfer`` only when ``DIB_DEEPINFER_MODULE=standins.fake_deepinfer_lockstep``
  is set (a warning names it); nothing selects it otherwise;
* ``scripted_engine`` (+ ``scripted_replies``, ``scripted_blocks``): engine ``scripted``, a model
  that emits scripted V4.1 outputs, for the end-to-end tests with real agent clients
  (``python -m deepinfer_backend serve --engine scripted --script FILE`` in a checkout);
* ``step_gate``: a wrapper that holds a rank's engine steps at a test's gate, applied only when
  ``DIB_TEST_ENGINE_WRAPPER=standins.step_gate`` is set (``rank/rank_setup.py``; a warning names it).

``publish.py`` leaves this package out of the archive (tests/server/test_publish_archive.py), so a
worker never has it: there engine ``scripted`` is refused with a clear message (``rank.engines``).
Product code imports it only lazily, behind that check.
"""
