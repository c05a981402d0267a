"""The operators' side: ledger, metrics, admin API, dashboard, stats CLI."""
