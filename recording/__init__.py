"""Recorded cases: the fixture file format (safetensors + JSON metadata), replaying a fixture
against the reference, capturing the plan/run pairs of any program that uses FlashInfer's MLA
wrapper, and the environment a recording ran on."""
