"""The store group's controller: etcd (its client, ``etcd``) and the group's state and rules in it (``group``).

The one package that speaks to etcd; in the store, only the role loop (``store/replica/role.py``) imports it.
"""
