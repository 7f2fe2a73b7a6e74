//! A minimal RESP2 client, the bench's own: one command in flight, sent in one vectored write,
//! the reply read in full (a bulk value into the spare capacity of a fresh buffer) before the
//! next.

use std::io::IoSlice;

use anyhow::{bail, ensure, Context};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A minimal RESP2 client: one command in flight, the reply read in full before the next.
pub(super) struct RespConnection {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    line: String,
}

impl RespConnection {
    pub(super) async fn connect(port: u16) -> anyhow::Result<RespConnection> {
        let stream = TcpStream::connect(("127.0.0.1", port)).await?;
        stream.set_nodelay(true)?;
        let (read_half, writer) = stream.into_split();
        Ok(RespConnection { reader: BufReader::with_capacity(64 << 10, read_half), writer, line: String::new() })
    }

    pub(super) async fn ping(&mut self) -> anyhow::Result<()> {
        self.command(&[b"PING"]).await.map(|_| ())
    }

    pub(super) async fn set(&mut self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        match self.command(&[b"SET", key.as_bytes(), value]).await? {
            Reply::Status(s) if s == "OK" => Ok(()),
            other => bail!("SET {key}: unexpected reply {other:?}"),
        }
    }

    pub(super) async fn get(&mut self, key: &str) -> anyhow::Result<Bytes> {
        match self.command(&[b"GET", key.as_bytes()]).await? {
            Reply::Bulk(Some(value)) => Ok(value),
            other => bail!("GET {key}: unexpected reply {other:?}"),
        }
    }

    /// Sends one command as a RESP array of bulk strings (headers and arguments in one
    /// vectored write, no copy of the arguments) and reads its reply.
    pub(super) async fn command(&mut self, args: &[&[u8]]) -> anyhow::Result<Reply> {
        let heads: Vec<Vec<u8>> = args
            .iter()
            .enumerate()
            .map(|(i, arg)| {
                let count = if i == 0 { format!("*{}\r\n", args.len()) } else { String::new() };
                format!("{count}${}\r\n", arg.len()).into_bytes()
            })
            .collect();
        let parts: Vec<&[u8]> =
            heads.iter().zip(args).flat_map(|(head, arg)| [head.as_slice(), arg, b"\r\n"]).collect();
        write_all_vectored(&mut self.writer, &parts).await?;
        self.read_reply().await
    }

    async fn read_reply(&mut self) -> anyhow::Result<Reply> {
        self.line.clear();
        if self.reader.read_line(&mut self.line).await? == 0 {
            bail!("redis closed the connection");
        }
        let line = self.line.trim_end_matches("\r\n");
        let (kind, rest) = line.split_at(line.len().min(1));
        match kind {
            "+" => Ok(Reply::Status(rest.to_string())),
            "-" => bail!("redis error: {rest}"),
            ":" => Ok(Reply::Status(rest.to_string())),
            "$" => {
                let len: i64 = rest.parse().with_context(|| format!("bad bulk length {rest:?}"))?;
                if len < 0 {
                    return Ok(Reply::Bulk(None));
                }
                ensure!(len <= 512 << 20, "bulk reply of {len} bytes is beyond Redis' limit");
                // Read into spare capacity, as Tern's reader does: no zeroing of the buffer first.
                let want = len as usize + 2;
                let mut value = BytesMut::with_capacity(want);
                let mut limited = (&mut self.reader).take(want as u64);
                while value.len() < want {
                    if limited.read_buf(&mut value).await? == 0 {
                        bail!("redis closed the connection in a bulk reply");
                    }
                }
                ensure!(value.ends_with(b"\r\n"), "bulk reply not ended by CRLF");
                value.truncate(len as usize);
                Ok(Reply::Bulk(Some(value.freeze())))
            }
            _ => bail!("unexpected RESP reply {line:?}"),
        }
    }
}

#[derive(Debug)]
pub(super) enum Reply {
    Status(String),
    Bulk(Option<Bytes>),
}

async fn write_all_vectored(writer: &mut tokio::net::tcp::OwnedWriteHalf, parts: &[&[u8]]) -> std::io::Result<()> {
    let (mut part, mut within) = (0usize, 0usize);
    while part < parts.len() {
        let slices: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(&parts[part][within..]))
            .chain(parts[part + 1..].iter().map(|p| IoSlice::new(p)))
            .collect();
        let mut n = writer.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while part < parts.len() && n >= parts[part].len() - within {
            n -= parts[part].len() - within;
            part += 1;
            within = 0;
        }
        within += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn vectored_writes_send_every_byte() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let big = vec![7u8; 3 << 20];
        let parts: Vec<&[u8]> = vec![b"*3\r\n", &big, b"\r\n"];
        let reader = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut all = Vec::new();
            s.read_to_end(&mut all).await.unwrap();
            all
        });
        let stream = TcpStream::connect(addr).await.unwrap();
        let (_r, mut w) = stream.into_split();
        write_all_vectored(&mut w, &parts).await.unwrap();
        drop(w);
        drop(_r);
        let all = reader.await.unwrap();
        assert_eq!(all.len(), 4 + big.len() + 2);
        assert!(all.starts_with(b"*3\r\n") && all.ends_with(b"\r\n"));
    }
}
