"""The long run (issue 31): hundreds of steps of SFT and DPO and a GRPO run on a task built from the base model's
own answers, every protection and the baselines a practitioner would pick instead, measured along each run.
`scripts/long_run.py` runs it; `plan.py` says what it runs, `measure.py` what it measures."""
