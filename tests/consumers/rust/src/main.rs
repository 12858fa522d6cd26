// A user's program: causal attention over two tokens (one head, head_dim 2) through the safe API.
use sparsa::{Attention, Context, Policy, TensorMut, TensorRef};

fn main() -> Result<(), sparsa::Error> {
    let shape = [1i64, 2, 1, 2];
    let (q, k, v) = ([1f32, 0., 0., 0.], [1f32, 0., 0., 1.], [1f32, 2., 3., 4.]);
    let mut out = [0f32; 4];
    let ctx = Context::cpu()?;
    let (qt, kt, vt) = (TensorRef::new(&q, &shape)?, TensorRef::new(&k, &shape)?, TensorRef::new(&v, &shape)?);
    let mut ot = TensorMut::new(&mut out, &shape)?;
    Attention::new(&qt, &kt, &vt, &mut ot).causal(true).run(&ctx, &Policy::dense())?;
    println!("sparsa {:?} out {:?}", sparsa::version(), out);
    Ok(())
}
