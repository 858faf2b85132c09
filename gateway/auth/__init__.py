"""Who may connect and what they may do: password file, ACL rules, the authenticator."""
