"""The run, without Flower: the DP round as data in, record out, and everything that persists it
(ledger, checkpoint, release journal, release registry, run lock and resume, disclosure)."""
