"""Measurement tools, aside from the request's path: nothing in the engine imports them.

machine.py measures the machine (bandwidth, FLOP/s) and stores it; roofline.py counts what a decode
step reads and computes and the tokens/s that allows; roofline_report.py (`wallbreaker roofline`),
bench.py (`wallbreaker bench`, beside the engines in baselines/), perplexity.py (`wallbreaker
perplexity`) and inspect_model.py (`wallbreaker inspect`) are the verbs; reporting.py and
workload.py are the tables, plots and prompts they share.
"""
