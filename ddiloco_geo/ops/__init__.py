"""What an operator runs against a run in a bucket: status, snapshot/restore/export, replay, report, selfcheck."""
