"""The backbone's side of remote experts: plan, fan out, combine, account."""
