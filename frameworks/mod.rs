//! Engine adapters. Each engine is a module behind its cargo feature; they translate the engine's
//! connector calls into the framework-agnostic core. Filled by the connector-protocol work.
