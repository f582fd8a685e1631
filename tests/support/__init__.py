"""Test support, imported as `support.*` (the rootdir conftest puts tests/ on sys.path; the workers get it
on PYTHONPATH): tiny models, a tiny tokenizer and a torchrun launcher (`tiny`), random anchors (`anchors`),
plain reference implementations (`references`), tiny Trainer runs (`training`), exact enumeration on a tiny
model (`enumeration`), the multi-process tests' shared setup (`distributed`) and a local fake Hub (`hub_server`)."""
