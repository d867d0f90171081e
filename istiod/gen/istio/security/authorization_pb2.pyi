from google.protobuf import empty_pb2 as _empty_pb2
from istiod.gen.istio.workload import workload_pb2 as _workload_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Scope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GLOBAL: _ClassVar[Scope]
    NAMESPACE: _ClassVar[Scope]
    WORKLOAD_SELECTOR: _ClassVar[Scope]

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOW: _ClassVar[Action]
    DENY: _ClassVar[Action]
GLOBAL: Scope
NAMESPACE: Scope
WORKLOAD_SELECTOR: Scope
ALLOW: Action
DENY: Action

class Authorization(_message.Message):
    __slots__ = ("name", "namespace", "scope", "action", "rules", "dry_run", "extensions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    scope: Scope
    action: Action
    rules: _containers.RepeatedCompositeFieldContainer[Rule]
    dry_run: bool
    extensions: _containers.RepeatedCompositeFieldContainer[_workload_pb2.Extension]
    def __init__(self, name: _Optional[str] = ..., namespace: _Optional[str] = ..., scope: _Optional[_Union[Scope, str]] = ..., action: _Optional[_Union[Action, str]] = ..., rules: _Optional[_Iterable[_Union[Rule, _Mapping]]] = ..., dry_run: _Optional[bool] = ..., extensions: _Optional[_Iterable[_Union[_workload_pb2.Extension, _Mapping]]] = ...) -> None: ...

class Rule(_message.Message):
    __slots__ = ("clauses",)
    CLAUSES_FIELD_NUMBER: _ClassVar[int]
    clauses: _containers.RepeatedCompositeFieldContainer[Clause]
    def __init__(self, clauses: _Optional[_Iterable[_Union[Clause, _Mapping]]] = ...) -> None: ...

class Clause(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[Match]
    def __init__(self, matches: _Optional[_Iterable[_Union[Match, _Mapping]]] = ...) -> None: ...

class Match(_message.Message):
    __slots__ = ("namespaces", "not_namespaces", "service_accounts", "not_service_accounts", "principals", "not_principals", "source_ips", "not_source_ips", "destination_ips", "not_destination_ips", "destination_ports", "not_destination_ports", "extensions")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NOT_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVICE_ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    PRINCIPALS_FIELD_NUMBER: _ClassVar[int]
    NOT_PRINCIPALS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IPS_FIELD_NUMBER: _ClassVar[int]
    NOT_SOURCE_IPS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_IPS_FIELD_NUMBER: _ClassVar[int]
    NOT_DESTINATION_IPS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_PORTS_FIELD_NUMBER: _ClassVar[int]
    NOT_DESTINATION_PORTS_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[StringMatch]
    not_namespaces: _containers.RepeatedCompositeFieldContainer[StringMatch]
    service_accounts: _containers.RepeatedCompositeFieldContainer[ServiceAccountMatch]
    not_service_accounts: _containers.RepeatedCompositeFieldContainer[ServiceAccountMatch]
    principals: _containers.RepeatedCompositeFieldContainer[StringMatch]
    not_principals: _containers.RepeatedCompositeFieldContainer[StringMatch]
    source_ips: _containers.RepeatedCompositeFieldContainer[Address]
    not_source_ips: _containers.RepeatedCompositeFieldContainer[Address]
    destination_ips: _containers.RepeatedCompositeFieldContainer[Address]
    not_destination_ips: _containers.RepeatedCompositeFieldContainer[Address]
    destination_ports: _containers.RepeatedScalarFieldContainer[int]
    not_destination_ports: _containers.RepeatedScalarFieldContainer[int]
    extensions: _containers.RepeatedCompositeFieldContainer[_workload_pb2.Extension]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[StringMatch, _Mapping]]] = ..., not_namespaces: _Optional[_Iterable[_Union[StringMatch, _Mapping]]] = ..., service_accounts: _Optional[_Iterable[_Union[ServiceAccountMatch, _Mapping]]] = ..., not_service_accounts: _Optional[_Iterable[_Union[ServiceAccountMatch, _Mapping]]] = ..., principals: _Optional[_Iterable[_Union[StringMatch, _Mapping]]] = ..., not_principals: _Optional[_Iterable[_Union[StringMatch, _Mapping]]] = ..., source_ips: _Optional[_Iterable[_Union[Address, _Mapping]]] = ..., not_source_ips: _Optional[_Iterable[_Union[Address, _Mapping]]] = ..., destination_ips: _Optional[_Iterable[_Union[Address, _Mapping]]] = ..., not_destination_ips: _Optional[_Iterable[_Union[Address, _Mapping]]] = ..., destination_ports: _Optional[_Iterable[int]] = ..., not_destination_ports: _Optional[_Iterable[int]] = ..., extensions: _Optional[_Iterable[_Union[_workload_pb2.Extension, _Mapping]]] = ...) -> None: ...

class Address(_message.Message):
    __slots__ = ("address", "length")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    address: bytes
    length: int
    def __init__(self, address: _Optional[bytes] = ..., length: _Optional[int] = ...) -> None: ...

class ServiceAccountMatch(_message.Message):
    __slots__ = ("namespace", "serviceAccount")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SERVICEACCOUNT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    serviceAccount: str
    def __init__(self, namespace: _Optional[str] = ..., serviceAccount: _Optional[str] = ...) -> None: ...

class StringMatch(_message.Message):
    __slots__ = ("exact", "prefix", "suffix", "presence")
    EXACT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    exact: str
    prefix: str
    suffix: str
    presence: _empty_pb2.Empty
    def __init__(self, exact: _Optional[str] = ..., prefix: _Optional[str] = ..., suffix: _Optional[str] = ..., presence: _Optional[_Union[_empty_pb2.Empty, _Mapping]] = ...) -> None: ...
