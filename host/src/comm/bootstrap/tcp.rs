//! The TCP bootstrap (being written).
