"""Surge (狂潮): a distributed training system whose module permissions are enforced by machine."""
